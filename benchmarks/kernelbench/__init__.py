"""The parts of ``benchmarks/kernel_bench.py`` (the command line), one concept a module; each
imports only the ones listed above it.

* ``timing``: how a call is timed (CUDA-graph replay or eager, L2 flushed), errors kept.
* ``setup``: ``Setup`` (shapes, pools) and the references: gathered K/V, eager reconstruct,
  SDPA, the copy rate.
* ``report``: a mode's result file: header, save after every case, PNG, printed table.
* ``prefill``: ``--prefill``, the prefill routes and the engine's layer call.
* ``decode``: the default mode: decode, shared-prefix decode, then the prefill routes.
* ``mixed``: ``--mixed``, a prefill chunk beside one-token rows.
* ``cascade_prefill``: ``--cascade-prefill``, a group's chunks over one shared prefix.
* ``decode_short``: ``--decode-short``, short sequences, static against dynamic split plan.
* ``cascade_split``: ``--cascade-split``, the split-form cascade launch by launch.
* ``cascade_sweep``: ``--cascade-sweep``, the prefix launch's tuning.
* ``variants``: ``--variants``, ResidualAttention decode variants against unified.
* ``registers``: ``--regs``, registers and spills for sm_90a, no GPU.
"""
