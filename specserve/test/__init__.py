"""Mirrors ``sglang.test`` for the documentation's notebook cells (``from specserve.test.doc_patch import ...``)."""
