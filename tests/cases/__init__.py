"""One module per real patch, each defining ``CASE = support.contract.Case(...)``."""
