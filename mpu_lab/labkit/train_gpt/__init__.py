"""Lab 14, training a GPT: ``launch/train_gpt.py`` jobs started from a notebook and their losses
(``runs``, lab 15 uses them too), the printed lessons around them (``lessons``), the checks
(``exercises``) and loss curves (``viz``).
"""
