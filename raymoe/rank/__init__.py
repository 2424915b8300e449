"""What runs inside a rank actor: a typed rank context and ``fn(ctx, ...)`` functions to load, train,
evaluate, infer and save. The driver sends these functions to the ranks; nothing here imports ``ray``."""
