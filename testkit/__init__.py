"""Test doubles for kidx's tests and benchmarks: stand-ins for an OpenAI-compatible embeddings
and chat API over real HTTP on 127.0.0.1 (`testkit.standin`). Not part of the distribution:
`pip install kidx` installs worker/, tasks/, scheduler/ and ops/ only."""
