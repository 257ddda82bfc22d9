"""Maintenance on top of the block and ref stores: reachability, GC, fsck, usage and diff.

Each module reads blocks and refs through their interfaces only; the repository calls them.
"""
