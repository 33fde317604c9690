"""The model on this machine: resolve a spec (hub repo id or folder), download, load."""
