"""The capacity planner: ``python -m rampart.plan`` (``rampart.plan.planner``) and its rules (``rampart.plan.formulas``)."""
