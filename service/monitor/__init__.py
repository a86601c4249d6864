"""The health monitor's judgements, pure Python (no torch, ray or workers): the workers
measure, these modules decide.

- `bandwidth`: nccl-tests arithmetic (busbw factors, algbw, busbw, the profile's expected
  busbw). The only part the workers import (`workers.monitor.comm_probe`,
  `workers.monitor.comm_timer`).
- `probe`: a bandwidth probe's rows judged against a hardware profile.
- `stragglers`: ranks whose compute time per step stays beyond their stage peers'.
- `hang`: which ranks never arrived when a job stops making progress.
- `placement`: TP groups placed across a slow link.
- `links`: which host has a slow link, from a probe round's pairs between hosts.
- `comm`: the `GET /api/v1/jobs/{id}/comm` view over the stored step reports.
- `attempt`: one running attempt's health state, fed by the controller's poll loop.
- `cluster_probe`: `trident probe` runs, started and collected by the controller.
- `calibration`: a `trident probe` run's reports into a calibrated hardware profile.

Import the submodules, not this package: it re-exports nothing, so that a worker importing
`service.monitor.bandwidth` pulls in nothing else.
"""
