"""What a run will cost before it starts: the model shape and workload, memory, time and price
per stage on the hardware named, and the probe that measures one real step to calibrate it.

Owns: cost, hardware, memory, model_shape, timing, workload, probe.
May import: anything else in the engine (the probe runs a real RL step); nothing imports it but the CLI.
"""
