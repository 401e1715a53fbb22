"""The config schema (Hydra ConfigStore) and the errors and helpers every check shares: the bottom layer.

    from hookrun.config.schema import RunConfig, ConfigError
"""
