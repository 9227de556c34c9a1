import torch, jaxtorch, warnings
import torch.nn.functional as F
warnings.simplefilter("ignore")
x = torch.randn(2,3,4,5)
w = torch.randn(1,3,1,1); b = torch.randn(1,3,1,1)
rm, rv = torch.zeros(3), torch.ones(3)
cases = {
 "bn_train": lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
 "bn_eval": lambda x, w, b: F.batch_norm(x, torch.zeros(3, device=x.device), torch.ones(3, device=x.device), w, b, training=False),
 "bn_rm4d": lambda x, w, b: F.batch_norm(x, torch.zeros(1,3,1,1, device=x.device), torch.ones(1,3,1,1, device=x.device), w.reshape(3), b.reshape(3), training=False),
 "in": lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
 "gn": lambda x, w, b: F.group_norm(x, 3, w, b),
 "ln": lambda x, w, b: F.layer_norm(x, (3,4,5), w.expand(3,4,5) if w.ndim==4 else w, None),
 "ln13": lambda x, w, b: F.layer_norm(x, (4,5), w.reshape(1,4,5) if w.numel()==20 else torch.ones(1,4,5,device=x.device)),
 "bn_w3x1": lambda x, w, b: F.batch_norm(x, None, None, w.reshape(3,1), b.reshape(3,1), training=True),
}
for k, f in cases.items():
    try: ref = f(x, w, b); r = "ok"
    except Exception as e: ref=None; r = "torch: " + type(e).__name__ + str(e)[:100]
    try:
        got = f(x.to("jax"), w.to("jax"), b.to("jax")).cpu()
        g = "match" if ref is not None and torch.allclose(ref, got, atol=1e-5) else f"got {got.shape}"
    except Exception as e: g = "jax: " + type(e).__name__ + str(e)[:150]
    print(k, r, "|", g)
