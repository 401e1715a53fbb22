"""What the hooks do: layer patterns, hook kinds and roles, edits, what is stored (dtype/reduce/select), tokens.

    from hookrun.capture.hooks import HookSet, build_plans
"""
