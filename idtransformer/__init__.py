"""ID transformer: global IDs to slots of a bounded table (issue 3)."""
