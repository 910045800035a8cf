"""Publishing stores to the Hugging Face Hub, and reading stores from remote URLs (hf://, s3://, https://).

    from hiddenstates.hub import publish
    publish("store", "my-org/my-hidden-states", license="apache-2.0")
"""

from hiddenstates.hub.limits import HubLimits, LimitViolation, check_layout
from hiddenstates.hub.publish import PublishConfig, PublishPlan, PublishResult, plan_publish, publish

__all__ = [
    "HubLimits",
    "LimitViolation",
    "PublishConfig",
    "PublishPlan",
    "PublishResult",
    "check_layout",
    "plan_publish",
    "publish",
]
