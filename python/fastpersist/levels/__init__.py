"""Checkpoint levels (docs/architecture.md, "Checkpoint levels"): where each rank's share of a step lives beyond its own
node (partner replicas), and restoring from the fastest level that still holds a verified copy.

* :mod:`.host`: the typed protocols between a Checkpointer and its levels (the ``LevelHost`` the levels see; no level
  reads a Checkpointer private); :mod:`.level_objects`: the level objects a Checkpointer takes (``Partner``,
  ``Remote``, ``HFExport``);
* the local level: :mod:`.local_level` (the root without partners: clean, index, retention, restore),
  :mod:`.local_steps` (a root's committed steps, its index, the newest step that verifies);
* the partner level: :mod:`.partner_holdings` (what a node's step holds), :mod:`.partner_restore` (agree on a step,
  read each share from the fastest copy that verifies), :mod:`.partner_level` (what a Checkpointer does with it);
* the remote level: :mod:`.remote_stores` (a directory, or S3 through obstore), :mod:`.remote_steps` (drain, commit,
  retention and download of steps), :mod:`.remote_drain` (the background thread), :mod:`.remote_drain_peers` (a
  group's drain outcomes, shared at once), :mod:`.remote_refill` (a step back from the remote into the local roots),
  :mod:`.remote_level` (what a Checkpointer does with it), :mod:`.remote_claims` (remote configurations that cannot
  work, such as one remote claimed by two live roots), :mod:`.remote_fetch` (``fp.load``, inspect and verify of
  ``s3://`` URLs);
* on every level: :mod:`.run_identity` (which steps are this run's), :mod:`.resume` (where a Checkpointer resumes
  from); :mod:`.background_exports`: a Checkpointer's background Hugging Face exports of committed steps.
"""
