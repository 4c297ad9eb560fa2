"""``from specserve.test.doc_patch import launch_server_cmd``: what the SGLang docs' notebook cells import."""

from specserve.utils import launch_server_cmd

__all__ = ["launch_server_cmd"]
