"""Test patch whose apply raises: the host import must still succeed."""


def apply(ctx):
    raise RuntimeError("boom from a broken patch")
