from sparsekv.policies.quest.policy import QuestPolicy

__all__ = ["QuestPolicy"]
