"""One run from a composed config: checks, the first-batch check, ranks, the loop, the summary.

    from hookrun.run.runner import run
    run(cfg)
"""
