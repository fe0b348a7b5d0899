"""Baseline schedulers against Helios on the simulator (issue 8); see README.md.

interface    streams, frames, lane results and the three-call scheduler interface
shapes       the smallest captured program that fits a chosen batch, chunk and width
queues       who gets a free request slot: FIFO or the Virtual Token Counter
speculation  decode width per round: plain, fixed k + 1, or SmartSpec's goodput choice
baselines    the prefill-first and decode-first engines and the named baseline set
driver       a discrete-event driver with helios.sim.simulator's device model
helios_adapter  the real Helios scheduler behind the interface (for the driver parity test)
workloads    the seeded workload set, scaled to the catalog's capacity
metrics      vLLM bench-serve metrics, Jain's index, VTC service difference
report       runs everything, writes report.md, results.json and PNG plots
"""
