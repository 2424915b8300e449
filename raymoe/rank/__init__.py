"""What runs inside a rank actor: a typed rank context and ``fn(ctx, ...)`` functions to load, train,
evaluate, infer and save, the messages they exchange with the driver (``contract.py``), and a world of one
rank in the driver's own process (``local.py``). The driver sends these functions to the ranks; nothing here
imports ``ray``."""
