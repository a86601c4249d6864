"""projects: whether a spent budget stops the project's running jobs

`budget_stop_running` (NULL or false: jobs that run when the budget is spent are left to
finish, only new ones are refused; true: the controller cancels them too). Nullable: the
rows there keep their meaning.

Revision ID: 0021
Revises: 0020
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("projects", sa.Column("budget_stop_running", sa.Boolean(), nullable=True))


def downgrade() -> None:
    # Not a batch: recreating `projects` on SQLite would cascade to its memberships.
    op.drop_column("projects", "budget_stop_running")
