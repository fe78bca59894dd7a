"""The `quality` workload (seed 001, Table 2): is sharing the base cache lossless enough?

SmolLM2-135M-Instruct with K LoRA adapters trained on disjoint BFCL function-calling tasks;
the agents share the function documentation as context and answer different items in every
KV layout. data (tasks, prompts), ast_check (scoring), train (PEFT), evaluate (the engine),
run_all.sh (the one command). docs/QUALITY.md has the method and the figures.
"""
