"""The RL stage (PPO, GRPO, RLOO, REINFORCE++): its inputs, the RL-run entry point every caller
opens steps with, one step, the experience records a step is built from, and the stage loop.

Owns: inputs, run (RLRun.open: the RL-run entry point), step, experience, dynamic_sampling,
tool_journal, stage.
"""
