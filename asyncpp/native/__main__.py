"""``python -m asyncpp.native``: build the native extension ahead of time."""

from . import load

print(f"asyncpp native extension ready: {load().__file__}")
