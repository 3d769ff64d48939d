"""`kidx backup`: an online copy while another process writes, checked and usable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from stack import REDIS_DB, broker_url
from worker.store import connect
from worker.store.items import add_item

WRITER = textwrap.dedent(
    """
    import sys, time
    from worker.store import connect
    from worker.store.items import add_item
    db = connect(sys.argv[1], vec=False)
    deadline = time.monotonic() + 3
    n = 0
    while time.monotonic() < deadline:
        add_item(db, kind="note", title=f"w{n}", content="written during the backup " * 20)
        n += 1
    print(n)
    """
)


def test_a_backup_taken_while_another_process_writes_is_whole(tmp_path: Path):
    source, dest = tmp_path / "live.db", tmp_path / "copy.db"
    db = connect(source, vec=False)
    for i in range(500):
        add_item(db, kind="note", title=f"n{i}", content="some text of a note " * 50)
    db.close()
    env = {
        **os.environ,
        "KIDX_DB": str(source),
        "HF_HUB_OFFLINE": "1",
        "KIDX_BROKER_URL": broker_url(REDIS_DB),
    }
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(source)], env=env, stdout=subprocess.PIPE, text=True
    )
    kidx = str(Path(sys.executable).parent / "kidx")
    out = subprocess.run(
        [kidx, "backup", str(dest), "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    written = int(writer.communicate(timeout=30)[0].strip())
    assert out.returncode == 0, out.stderr
    assert '"integrity": "ok"' in out.stdout and written > 0
    copy = connect(dest, vec=False)
    assert copy.scalar("PRAGMA integrity_check") == "ok"
    assert 500 <= copy.scalar("SELECT count(*) FROM knowledge_items") <= 500 + written
    copy.close()
    again = subprocess.run(
        [kidx, "backup", str(dest)], env=env, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 1 and "exists" in again.stderr
