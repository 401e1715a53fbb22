"""The on-disk format both the writer and the read side import: its names, how its files are read, how a store
is checked, and where a key lives.

    layout     every key, table, column and root attr, the format version and the bfloat16 codec, written once
    files      the index tables (merged, else the committed parts) and chunks, read and checked as recorded
    verify     a store checked against what its commits and its close recorded
    location   a local path or a URL behind one Zarr store object
"""
