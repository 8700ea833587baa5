"""The node's store in shared memory: its layout, READY and progress, space and reservation, the
spare-page pool, the ``current`` link, the verified-chunk index, chunk lists, have-bitfields and
the file-level work on them."""
