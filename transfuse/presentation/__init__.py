"""What shows a rewrite to a person: the coloured diff and the review page (``diffview``).

It sits above the api (it reads ``transfuse.report``) and below the command line, which prints it.
"""
