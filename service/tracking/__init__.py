"""Tracking: a job's stored metrics sent where people already look (MLflow, TensorBoard).

An exporter beside the controller (`exporter.Exporter`, stepped by `service.control.controller` on
the leader only) reads what the store has, turns each step into named scalars (`scalars`), and
sends them in batches through a sink (`mlflow_sink`, `tensorboard_sink`); a cursor per job and
sink in the store (`exports`) says how far each got, so a tracker that is down or slow costs
training nothing and gets every step once it is back; `config` is the server's trackers. The
job spec's `tracking` section is `service.contract.spec.TrackingSpec`, confined by
`service.submission.confine`.
The package imports neither MLflow nor TensorBoard until a sink is made.
"""
