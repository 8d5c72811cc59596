"""ID transformer: global IDs to slots of a bounded table (issue 3, in progress: admission.py so far)."""
