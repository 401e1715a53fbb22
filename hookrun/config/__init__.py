"""The config schema (Hydra ConfigStore) and the errors and helpers every check shares: the bottom layer.
The config reference's tables (docs/reference/config.md) are made from the schema by hookrun.config.table.

    from hookrun.config.schema import run_schema, ConfigError
"""
