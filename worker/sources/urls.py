"""The text of a URL, fetched without letting the fetcher reach into the host's own network.

Why it looks the way it does:

* Every host, the first and each redirect target's, is resolved and refused when ANY of its
  addresses is not global (loopback, private, link-local, ...), unless `UrlSettings.allow_hosts`
  names the host or covers the address. Redirects are followed by hand so that each is checked.
* The connection goes to the address that was checked (the URL's host replaced by the IP, the
  original `Host` header and TLS server name), so a second DNS answer cannot rebind the host to
  an internal address between the check and the request.
* The size limit holds while streaming, on the body as it comes and as it decompresses: the
  body is read raw and inflated here a bounded amount at a time (`read_body`), one content
  coding at most (httpx inflated `gzip, gzip` layer by layer, whole, before any check);
  the content type must be on the allow-list.
* Refusals are `InvalidInput` (retrying cannot help); timeouts, connection errors, 408, 429,
  5xx and a compressed body cut short are `SourceUnavailable` (a later retry may work).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from worker import net
from worker.errors import InvalidInput, SourceUnavailable
from worker.providers.http import (
    ACCEPT_ENCODING,
    BodyIncomplete,
    BodyRefused,
    read_body,
    safe_url,
)
from worker.settings import UrlSettings, allowed_host
from worker.sources.decoding import decode_text, decode_xml
from worker.sources.docx import docx_to_markdown
from worker.sources.files import html_text
from worker.sources.limits import check_text_size
from worker.sources.pdf import pdf_text

Resolver = Callable[[str, int], list[str]]
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

REDIRECTS = frozenset({301, 302, 303, 307, 308})
HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
XML_SUFFIXES = ("/xml", "+xml")  # their charset is in their XML declaration
DOCX_TYPE = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


@dataclass(frozen=True)
class Fetched:
    """A fetched page's text, the URL it finally came from, and its media type."""

    text: str
    final_url: str
    content_type: str


def system_resolve(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for `host` (IPv4 and IPv6), within the
    fetch's deadline (the resolver itself takes no timeout)."""
    try:
        infos = net.bounded(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    except net.DeadlinePassed as e:
        raise SourceUnavailable(f"{host}: name resolution took too long ({e})") from None
    except socket.gaierror as e:
        if e.errno == socket.EAI_AGAIN:
            raise SourceUnavailable(f"{host}: name resolution failed for now ({e})") from None
        raise InvalidInput(f"{host}: no such host ({e.strerror or e})") from None
    return list(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))


def _public(ip: IPAddress) -> bool:
    """Global unicast, judged also by any IPv4 address it carries (mapped, NAT64, 6to4,
    Teredo): `is_global` alone passes global-scope multicast and NAT64 of 127.0.0.1."""
    inner: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped:
            inner = [ip.ipv4_mapped]
        if ip in _NAT64:
            inner.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.sixtofour:
            inner.append(ip.sixtofour)
        if ip.teredo:
            inner.extend(ip.teredo)
    return all(
        a.is_global
        # site-local fec0::/10: deprecated, still routed inside some networks, and global to
        # Python 3.11's `is_global`
        and not (
            a.is_multicast
            or a.is_reserved
            or a.is_unspecified
            or getattr(a, "is_site_local", False)
        )
        for a in inner
    )


class _Policy:
    """`allow_hosts` split into host names and networks, each entry read as the settings
    validated it (`allowed_host`): an entry that is neither is refused here too, never taken
    for a host name that no URL has (settings built without validation: `model_construct`)."""

    def __init__(self, settings: UrlSettings) -> None:
        self.names: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in settings.allow_hosts:
            try:
                allowed = allowed_host(entry)
            except ValueError as e:
                raise InvalidInput(f"KIDX_URLS__ALLOW_HOSTS: {e}") from None
            if isinstance(allowed, str):
                self.names.add(allowed)
            else:
                self.networks.append(allowed)

    def allowed(self, ip: IPAddress) -> bool:
        return any(ip.version == net.version and ip in net for net in self.networks)

    def check(self, host: str, port: int, resolve: Resolver) -> list[str]:
        """The addresses to connect to, all checked; refuse if any is not global."""
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            addresses = [ipaddress.ip_address(a) for a in resolve(host, port)]
        if not addresses:
            raise InvalidInput(f"{host}: the name has no addresses")
        if host.lower().rstrip(".") not in self.names:
            for ip in addresses:
                if not _public(ip) and not self.allowed(ip):
                    what = host if str(ip) == host else f"{host} resolves to {ip}, which"
                    raise InvalidInput(
                        f"{what} is not a public address (loopback, private, link-local, "
                        "multicast or reserved); add it to KIDX_URLS__ALLOW_HOSTS to fetch it"
                    )
        return [str(ip) for ip in addresses]


def check_url(url: str) -> str:
    """A URL that may become an item: http(s), with a host, without credentials (they would
    be stored, shown and logged); refused with the reason, naming it without them."""
    parsed = _parse(url)
    if parsed.userinfo:
        raise InvalidInput(
            f"{safe_url(url)}: a URL with credentials (user:password@) is not fetched; kidx "
            "would store them with the item"
        )
    return url


def _parse(url: str, base: httpx.URL | None = None) -> httpx.URL:
    """An http(s) URL with a host (`url` relative to `base` when given), or a refusal."""
    shown = safe_url(url)
    try:
        parsed = base.join(url) if base is not None else httpx.URL(url)
        host = parsed.host  # (decoded when asked: idna's error for `http://xn--a.example/`,
        # whose redirect failed every item of a bulk run as a bug)
    except (httpx.InvalidURL, TypeError, UnicodeError) as e:
        raise InvalidInput(f"{shown}: not a valid URL ({safe_url(str(e))})") from None
    if parsed.scheme not in ("http", "https"):
        raise InvalidInput(f"{shown}: only http and https URLs can be fetched")
    if not host:
        raise InvalidInput(f"{shown}: the URL has no host")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        # the resolver takes it modulo 65536, or raises OverflowError past a C long
        raise InvalidInput(f"{shown}: the port {parsed.port} is not between 1 and 65535")
    return parsed


def _media_type(response: httpx.Response) -> tuple[str, str | None]:
    """The media type without parameters, and the charset parameter if any."""
    header = response.headers.get("content-type", "")
    media, _, params = header.partition(";")
    charset = None
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            charset = value.strip().strip("\"'") or None
    return media.strip().lower(), charset


def _status(url: httpx.URL, response: httpx.Response) -> None:
    code = response.status_code
    message = f"{url}: HTTP {code} {response.reason_phrase}".rstrip()
    if code in (408, 429) or code >= 500:
        raise SourceUnavailable(message)
    if not 200 <= code < 300:
        raise InvalidInput(message)


def _body(url: httpx.URL, response: httpx.Response, settings: UrlSettings) -> bytes:
    """The body, decompressed, refused as soon as it passes the size limit sent or unpacked
    (the time allowed is the fetch's deadline, which every read honours)."""
    limit = settings.max_bytes
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise InvalidInput(f"{url}: over the size limit of {limit} bytes ({declared} declared)")
    try:
        return read_body(response, limit)
    except BodyIncomplete as e:  # a server that failed while compressing: it may not next time
        raise SourceUnavailable(f"{url}: {e}") from None
    except BodyRefused as e:
        raise InvalidInput(f"{url}: {e}") from None


def _empty(url: httpx.URL, response: httpx.Response) -> InvalidInput:
    code = response.status_code
    if code in (204, 205):
        return InvalidInput(f"{url}: no content (HTTP {code} {response.reason_phrase})".rstrip())
    return InvalidInput(f"{url}: the page is empty (HTTP {code}, no body); nothing to index")


def _to_text(
    url: httpx.URL, data: bytes, media: str, charset: str | None, settings: UrlSettings
) -> str:
    """The page's text, refused past the size limit in characters however small the body: a
    compressed PDF or DOCX can unpack to far more."""
    limit = settings.max_bytes
    name = str(url)
    if media in HTML_TYPES:
        text = html_text(
            data,
            name,
            charset,
            max_bytes=settings.max_html_bytes,
            max_elements=settings.max_html_elements,
            xml=media.endswith(XML_SUFFIXES),
        )
        if text is None:
            raise InvalidInput(f"{url}: no main text could be extracted from the page")
    elif media == "application/pdf":
        text = pdf_text(data, name, limit=limit, max_content=settings.max_pdf_content_bytes)
    elif media == DOCX_TYPE:
        text = docx_to_markdown(data, name, limit=limit, max_xml=settings.max_xml_bytes)
    elif media.endswith(XML_SUFFIXES):
        text = decode_xml(data, name, charset)
    elif media.startswith("text/") or media.endswith(("/json", "+json")):
        text = decode_text(data, name, charset)
    else:
        raise InvalidInput(f"{url}: cannot read content of type {media}")
    if not text.strip():
        raise InvalidInput(f"{url}: the page contains only white space; nothing to index")
    return check_text_size(text, name, limit)


# httpx's error for a redirect's Location it cannot parse (a transport error otherwise).
BAD_LOCATION = "Invalid URL in location header"
# h11's error for a status line and headers longer than httpcore lets it buffer (100 KB).
OVERSIZED_HEADER = "Receive buffer too long"


def _send(
    client: httpx.Client,
    url: httpx.URL,
    ips: list[str],
    headers: dict[str, str],
    timeout: httpx.Timeout,
) -> httpx.Response:
    """GET `url` from the checked addresses in turn, with the original Host and TLS name."""
    host = url.raw_host.decode("ascii")
    extensions = {"sni_hostname": host} if url.scheme == "https" else {}
    headers = {**headers, "Host": url.netloc.decode("ascii")}
    for i, ip in enumerate(ips):
        request = client.build_request(
            "GET", url.copy_with(host=ip), headers=headers, extensions=extensions, timeout=timeout
        )
        try:
            return client.send(request, stream=True, follow_redirects=False)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            if i == len(ips) - 1:
                raise
        except httpx.RemoteProtocolError as e:
            if not str(e).startswith(BAD_LOCATION):
                raise
            # a Location such as `http://[::1`: the server's answer, the same next time
            raise InvalidInput(
                f"{safe_url(str(url))}: the server redirects to a URL that is not valid"
            ) from None
        except (UnicodeError, httpx.InvalidURL) as e:  # httpx reads a redirect's Location
            # even when not following it: idna's error for a host such as `xn--a.example`, and
            # the InvalidURL of a `mailto:` or `data:` one, failed every item of a bulk run
            raise InvalidInput(
                f"{safe_url(str(url))}: the server answered with a URL that is not valid "
                f"({safe_url(str(e))})"
            ) from None
    raise AssertionError("unreachable: no addresses")  # _Policy.check never returns none


def fetch_url(
    url: str,
    settings: UrlSettings,
    *,
    resolve: Resolver | None = None,
    client: httpx.Client | None = None,
    user_agent: str = "kidx/0.1 (+https://github.com/kidx)",
    cancel: net.CancelCheck | None = None,
) -> Fetched:
    """Fetch `url` and return its text (Markdown for HTML), refusing what the settings do not
    allow. Everything (names resolved, redirects, headers, body) happens within
    `settings.timeout` in all, however slowly a server trickles; `cancel` ends it between
    two waits of at most a quarter of a second (Cancelled). `resolve` replaces the system
    resolver; `client` a fresh httpx client (give one without proxies, a proxy would resolve
    the name itself and undo the address check, and with a `net.DeadlineTransport`)."""
    policy = _Policy(settings)
    resolve = resolve or system_resolve
    timeout = httpx.Timeout(settings.timeout, connect=settings.connect_timeout)
    accept = ", ".join(settings.content_types) + ", */*;q=0.1"
    headers = {"User-Agent": user_agent, "Accept": accept, "Accept-Encoding": ACCEPT_ENCODING}
    own = client is None
    http = client or httpx.Client(
        timeout=timeout,
        follow_redirects=False,
        trust_env=False,
        transport=net.DeadlineTransport(),
    )
    current = start = _parse(check_url(url))
    shown = safe_url(url)
    seen = {str(current)}
    stack = contextlib.ExitStack()
    stack.enter_context(net.deadline(settings.timeout, cancel))
    try:
        for _ in range(settings.max_redirects + 1):
            port = current.port or (443 if current.scheme == "https" else 80)
            try:
                ips = policy.check(current.raw_host.decode("ascii"), port, resolve)
            except InvalidInput as e:
                where = url if current == start else f"{url} redirects to {current}"
                raise InvalidInput(f"{where}: {e}") from None
            response = _send(http, current, ips, headers, timeout)
            try:
                location = response.headers.get("location")
                if response.status_code in REDIRECTS and location:
                    target = _parse(location, current)
                    if target.userinfo:
                        raise InvalidInput(
                            f"{shown}: redirects to a URL with credentials "
                            f"({safe_url(str(target))}); not followed"
                        )
                    if str(target) in seen:
                        raise InvalidInput(f"{url}: redirect loop (at {target})")
                    seen.add(str(target))
                    current = target
                    continue
                _status(current, response)
                declared = response.headers.get("content-length", "").strip()
                if response.status_code in (204, 205) or (declared.isdigit() and not int(declared)):
                    raise _empty(current, response)  # says more than its missing type would
                media, charset = _media_type(response)
                if media not in {t.strip().lower() for t in settings.content_types}:
                    # No type and no length: whether the body (read until the server closes,
                    # bounded as any body is) is empty says more than the missing type.
                    if not media and not declared and not _body(current, response, settings):
                        raise _empty(current, response)
                    shown = media or "none given"
                    raise InvalidInput(f"{current}: content type {shown} is not allowed")
                data = _body(current, response, settings)
                if not data:
                    raise _empty(current, response)
            finally:
                response.close()
            text = _to_text(current, data, media, charset, settings)
            return Fetched(text, str(current), media)
        raise InvalidInput(f"{url}: too many redirects (more than {settings.max_redirects})")
    except httpx.TimeoutException as e:
        detail = str(e) or type(e).__name__
        raise SourceUnavailable(f"{safe_url(str(current))}: timed out ({detail})") from None
    except httpx.DecodingError as e:
        raise InvalidInput(
            f"{safe_url(str(current))}: the body could not be decoded ({e})"
        ) from None
    except httpx.TransportError as e:
        if isinstance(e, httpx.RemoteProtocolError) and str(e) == OVERSIZED_HEADER:
            # what the server would send again: retried, it failed three times as unavailable
            raise InvalidInput(
                f"{safe_url(str(current))}: the server's answer has a header too large to read "
                "(over httpcore's 100 KB)"
            ) from None
        raise SourceUnavailable(f"{safe_url(str(current))}: {type(e).__name__}: {e}") from None
    finally:
        stack.close()
        if own:
            http.close()
