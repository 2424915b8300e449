"""Driver side, over a group of ranks: the model handle (DistributedModel), the group protocol it uses,
batch checking and splitting, the Trainer with its data, schedule and metrics, and the tiny demo model."""
