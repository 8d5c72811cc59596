"""What every part of dynemb stands on: its version, the user-error type, the native build.

Nothing here imports another part of dynemb, so the ID transformer, the PS and the trainer
can all import it and the CLI sits on top of them all.
"""
