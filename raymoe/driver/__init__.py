"""Driver side, over a group of ranks: the model handle (``handle.py``, a facade over its rooms: inference,
training, hub save, training states, tenancy, one fan-out), the group protocol it uses, the Trainer with its
parts (config, run directory, resume, failure policy, batch order, interrupts, records), and the data on its
way to the handle (tokenizer, chat templates, records, tokenization and its cache, packing, dataset files)."""
