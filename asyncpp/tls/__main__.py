"""``python -m asyncpp.tls``: build the thread-local-state extension ahead of time."""

from .build import load

print(f"asyncpp TLS extension ready: {load().__file__}")
