"""Test support: ``tiny`` builds the tiny random-weight models the tests and benchmarks run on, and ``doc_patch``
mirrors ``sglang.test.doc_patch`` for the documentation's notebook cells (``from specserve.test.doc_patch import
...``)."""
