"""Promotion: whether a round's final policy may become the champion the next round starts from.

Owns: gates (GATE_METRICS, check_gate, decide_promotion, gate_table): pure decisions on a round's
summary row; the flow records them (flows/promotion.py: the registry alias, tags, the Prefect artifact).
May import: nothing of rlflow (the config validates a gate's metric against GATE_METRICS).
"""
