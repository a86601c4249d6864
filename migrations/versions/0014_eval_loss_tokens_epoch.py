"""step_metrics: eval_loss, tokens, epoch

A job that trains on corpora (`data.kind: tokens`, docs/data.md) reports with its steps the
validation loss (on the steps that evaluated, every `data.eval_every`), the tokens trained on
so far and the epoch; the job-level row keeps them beside the loss, for the job page's chart,
`trident status -o wide` and `trident_job_eval_loss`. Nullable: synthetic jobs, steps without
an evaluation and the rows stored before this revision have none.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("step_metrics") as batch:
        batch.add_column(sa.Column("eval_loss", sa.Float(), nullable=True))
        batch.add_column(sa.Column("tokens", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("epoch", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("step_metrics") as batch:
        batch.drop_column("epoch")
        batch.drop_column("tokens")
        batch.drop_column("eval_loss")
