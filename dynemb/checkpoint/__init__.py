"""Checkpoints of a job with dynamic tables (`dynemb checkpoint`) and portable table folders
(`dynemb table`): every row with its optimizer state, restorable on any number of ranks."""
