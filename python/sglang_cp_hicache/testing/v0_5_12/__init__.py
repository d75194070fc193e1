"""The 0.5.12.post1 line's CPU runtime (``runtime``) and its stack builders and test models."""
