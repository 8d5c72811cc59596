"""Publishing for serving (issue 33): versions of the tables that a serving fleet can follow.

Being built: the dtypes a version's rows travel in (quantize.py) come first.
"""
