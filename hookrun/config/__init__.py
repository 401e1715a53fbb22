"""The config, the bottom layer: its schema, the words every check shares, the parse and its hash, the registry.

Each job in its own module: schema (every key, typed; Hydra's ConfigStore), checks (ConfigError, check_choice,
as_list, target_of, ...), parsing (parse, once at the edge, and config_hash), commandline (overrides and a sweep's
launcher checked before Hydra), registry (the methods), yamlcheck (the YAML files' syntax); the config reference's
tables (docs/reference/config.md) are made from the schema by hookrun.config.table.

    from hookrun.config.checks import ConfigError
    from hookrun.config.parsing import parse
    from hookrun.config.schema import run_schema
"""
