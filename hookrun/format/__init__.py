"""The on-disk format both the writer and the read side import: its names, how its files are read and how a store
is checked (the bytes themselves travel through hookrun.storage).

    layout     every key, table, column and root attr, the format version and the bfloat16 codec, written once
    files      the index tables (merged, else the committed parts; parquet) and chunks, read and checked as recorded
    verify     a store checked against what its commits and its close recorded
"""
