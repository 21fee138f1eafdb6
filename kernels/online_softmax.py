"""The online-softmax step the CPU forms of the attention kinds (attention, kv_attention) share."""


def online_softmax(T, rows, bn, d):
    """A macro `step(s, m, m_prev, lsum, acc)` folding one tile of scores s[rows, bn] (pre-scaled
    for exp2, masked keys at -inf) into the running max m, sum lsum and output acc[rows, d]:
    m_prev keeps the old max, s becomes the tile's exp2 weights and acc is rescaled to the new max;
    the caller then adds the weighted values to acc."""
    ninf = -T.infinity("float32")

    @T.macro
    def step(s, m, m_prev, lsum, acc):
        for i in T.serial(rows):
            m_prev[i] = m[i]
            for j in T.serial(bn):
                m[i] = T.max(m[i], s[i, j])
        # Rows with every key masked so far keep m = -inf; exp2 of that must not be NaN.
        for i, j in T.grid(rows, bn):
            s[i, j] = T.if_then_else(m[i] == ninf, 0, T.exp2(s[i, j] - m[i]))
        for i in T.serial(rows):
            r = T.if_then_else(m[i] == ninf, 1, T.exp2(m_prev[i] - m[i]))
            lsum[i] = lsum[i] * r
            for c in T.serial(d):
                acc[i, c] = acc[i, c] * r
            for j in T.serial(bn):
                lsum[i] += s[i, j]

    return step
