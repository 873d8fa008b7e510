"""The code MLflow runs to build a shardtrain pyfunc model when it loads one ("models from code",
training.mlflow_model): the model is built here, never unpickled. MLflow copies this file into
every logged model; it must stay this small and import only shardtrain's installed package."""

from mlflow.models import set_model

from training.mlflow_model import ShardtrainPyfunc

set_model(ShardtrainPyfunc())
