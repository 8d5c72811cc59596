"""TorchRec training behind the ID transformer (later issues)."""
