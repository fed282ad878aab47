"""The user-facing trace API and the bridge to the caller's event loop."""
