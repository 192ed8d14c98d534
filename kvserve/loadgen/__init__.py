"""Load generation and its statistics, shared by the benchmarks (`kvserve bench`) and the
simulator (`kvserve sim`), which compare their figures: when requests arrive (arrivals.py),
one streamed completion timed from the client (client.py), a server driven at a rate
(load.py), percentiles and goodput (stats.py), and the machine a figure was measured on
(machine.py). It imports nothing from bench/ or sim/."""
