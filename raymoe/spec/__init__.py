"""Driver side, pure: what the user asked for (DistributedConfig), where every rank sits (topology),
which style goes where (plans), the optimizer settings, and the frozen launch spec sent to every rank."""
