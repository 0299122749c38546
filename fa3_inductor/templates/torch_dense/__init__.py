"""The torch family: attention as dense torch ops, the last resort (family.py, dense.py)."""
