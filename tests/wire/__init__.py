"""The wire format: the codec, routing, and a foreign client that follows docs/wire-format.md."""
