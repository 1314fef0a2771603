"""The PLE n-gram table: its layout, the row-id hashing, the table file, page prefetch and the drive check."""
