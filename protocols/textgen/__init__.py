"""The text-generation schema family shared by the ``lmi`` and ``tgi`` protocol packages: TGI's
``GenerateParameters`` / ``GenerateResponse`` and LMI's rolling-batch variant of them (one
tolerant parameter reader with two dialects, one set of response writers and stream framings).
Not a protocol itself: it has no routes.
"""
