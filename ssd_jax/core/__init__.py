"""The decode core: rows and their state (rows.py, batch.py), speculation basics shared by SD
and SSD (speculation.py), exact verification (verify.py), the target's step (target.py), the
draft side (draft.py, backups.py, fanout.py), the transport between the two (transport.py), and
the loops that drive AR, SD and SSD rounds (rounds.py). Nothing here imports training
(`ssd_jax.distill`), planning (`ssd_jax.plan`) or the runtime (`ssd_jax.runtime`)."""
